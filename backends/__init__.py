"""The upstream side: connection pool, SGLang client, backend registry, and the CPU stand-in."""
