"""Object stores, chosen by URL (see open_store)."""
