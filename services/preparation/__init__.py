"""The preparation service (`PreparationService`): the engine registry, KV and expert budgets,
placement and staging."""
