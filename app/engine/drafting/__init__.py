"""The engine's drafters: what proposes tokens for the target to verify (app.engine.drafting.base: the contract)."""
