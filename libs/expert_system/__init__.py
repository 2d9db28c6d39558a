"""SDK placeholder for install test."""
