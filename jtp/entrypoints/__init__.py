"""What users run: the `jtp` command line, the offline batch script and the HTTP server."""
