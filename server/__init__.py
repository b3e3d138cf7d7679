"""psg_server: gRPC frontend and Ray worker pool of the psg gradient service."""
