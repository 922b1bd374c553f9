"""P0: bankml in front of a real llama-server, which it launches and supervises or checks.

- service.py: the mode's service (verify, the gateway, the engine, the site, in that order)
- gateway.py: the upstream, its state and the identity checks
- routes.py: the route table (every llama-server endpoint, bankml's own)
- answers.py: llama-server's answers read for their receipts (pure)
- llama_args.py: llama-server's arguments after ``--``, and those refused

Beside this package, the two modules the design names: ``bankml/proxy_resource.py`` (forwarding,
receipts on the way) and ``bankml/process_protocol.py`` (launching and supervising llama-server).
"""
