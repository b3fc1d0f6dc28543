"""The weight-sync service: versioned policy weights over gRPC (Push, Watch, Pull, Latest, List)."""
