"""Hook factories (TransformerLens and HF): interventions never mutate the model."""
