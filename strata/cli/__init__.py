"""The `strata` command."""
