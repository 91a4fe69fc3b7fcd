"""Fine-tuning jobs in the API apart from their routes: the checks at create (the spec, the data with
the model's tokenizer, the capacity of live workers) and the read side (rows -> job objects)."""
