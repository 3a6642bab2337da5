"""The layer above the checker that talks to services: audit campaigns over RQ workers and one
Redis (`campaign`, its report `report`), the shared example database in Redis and the Redis
server a campaign starts (`redis_db`), and live KV-event streams over ZMQ (`live_events`).

The checker (``kvspec.conformance``) judges; it never imports redis, rq or zmq. What it needs
from here, an example database, it is handed (the CLI opens it with `redis_db.open_database`).
redis, rq and pyzmq themselves are imported inside the functions that use them: they are the
``campaign`` and ``events`` extras.
"""
