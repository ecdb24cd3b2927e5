"""The HTTP app of `kvtier serve`: routes, request bodies, metrics."""
