"""The router service (`RouterService`): features, expert selection over Qdrant, parameter tuning,
the expert registry and the feedback consumer."""
