"""Generated gRPC stubs (python -m tandem.protogen). Do not edit."""
