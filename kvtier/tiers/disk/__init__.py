"""The disk tier: KV blocks as LMDB values (`tier.DiskTier`), with its file format, index,
checks, recovery and admin."""
