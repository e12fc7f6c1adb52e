"""ServeConfig and its options; generation profiles."""
