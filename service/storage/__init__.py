"""Storage: the schema (models), the episode queue (queue), batches, and token arrays as binary blobs."""
