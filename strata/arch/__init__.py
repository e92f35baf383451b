"""Per-architecture metadata and tensor tables beyond the shared ones in strata.config."""
