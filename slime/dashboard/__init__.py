"""The buffer API and live dashboard of one job (docs/dashboard.md)."""
