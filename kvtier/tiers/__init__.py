"""The tiers below the GPU: the host slab (`host`), and the tiers below it, each in a folder of
its own behind one interface (`base.LowerTier`): `disk/` (LMDB), `remote/` (Redis) and
`directory/` (one file per block). `record` is the block record they all store."""
