"""The run's Redis contract: every key and hash field (`keys.py`), the work queue and its Lua
(`queues.py`, `queue_scripts.py`), the ledger (`ledger.py`), the bounded client and the embedded
server."""
