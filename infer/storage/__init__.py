"""Where an artifact's bytes live: weight files on disk, their page-aligned layout, and read-only mappings."""
