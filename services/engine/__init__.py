"""The engine service: the engine library (`libs.engine`) behind gRPC.

Only the service's own parts live here: the gRPC front (`server.py`), membership in preparation's
fleet (`registration.py`), its settings (`config.py`), its metrics (`metrics.py`) and the process
(`__main__.py`).
"""
