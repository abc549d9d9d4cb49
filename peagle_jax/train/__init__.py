"""Training logic for the P-EAGLE drafter: COD sampling and the objective (entry points live in ``train/``)."""
