"""psg_client: Python client for the psg gradient service."""
