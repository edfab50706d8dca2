"""Generated gRPC stubs; do not edit. Regenerate: ``python -m hwr_client.protogen``."""
