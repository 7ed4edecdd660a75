"""Indexes, chosen by URL (see open_index)."""
