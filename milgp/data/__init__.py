"""Data: bags in memory (flat instances plus a bag index), the standardisation scale, a synthetic MIL set, atomic file writes."""
