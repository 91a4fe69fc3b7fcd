"""HTTP routers: files, fine-tuning jobs, health."""
