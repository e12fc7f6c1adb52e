"""Ray Data jobs over Parquet: the job, its engine actor, I/O, rows, commits."""
