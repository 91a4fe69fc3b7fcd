"""Base models: the built-in catalogue and local Hugging Face folders (``catalog``), a folder's checks
before a job is accepted (``folder_check``), LoRA and the weights a checkpoint exports (``lora``)."""
