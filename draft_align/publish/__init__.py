"""Publishing drafts: engine-format checkpoints (atomic, versioned, checksummed) and engine refreshers."""
