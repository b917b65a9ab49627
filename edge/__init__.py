"""quicedge's request side: the ASGI app and its stages, routing, configuration and the CLI."""
