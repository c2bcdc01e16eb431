"""The rest of stock ``generate``'s contract around the paged call: the cache it returns and
takes (``cache.py``; a hybrid model's recurrent states in it, ``states.py``), and the decision
on every option and argument (``options.py``)."""
