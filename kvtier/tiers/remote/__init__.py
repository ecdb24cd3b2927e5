"""The remote tier: KV blocks shared through Redis / Redis Cluster (`tier.RemoteTier`), its
nodes, config and admin. Importing this package imports no redis; `tier`, `nodes` and
`admin` do."""
