"""Graders in OpenAI's shapes (``contract.graders``): each type a module of its own; a reward with
OpenAI's error flags (:mod:`.result`), never an exception to the caller."""
