"""The worker's HTTP API: its wire models, its server (in the worker) and its typed client (in
the controller and the API server)."""
