"""Operations: the admin app, stats registry and reporter, timelines."""
