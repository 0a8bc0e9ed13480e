"""The scheduler service: the EngineCore loop (schedule -> execute -> update). Imports no torch."""
