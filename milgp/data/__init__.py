"""Data: bags in memory (flat instances plus a bag index), a synthetic MIL set, atomic file writes."""
