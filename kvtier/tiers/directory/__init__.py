"""The directory tier: one file per block in a plain directory (`tier.DirectoryTier`)."""
