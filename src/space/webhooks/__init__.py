"""Lifecycle webhooks: a tenant's endpoints told when its sandboxes change.

`events` turns the sandboxes' event rows into webhook events; `signing` signs and checks a
delivery (HMAC-SHA256 over its timestamp and body); `targets` keeps deliveries inside the egress
floor; `dispatch` is the leader's loop that queues and sends them, retried with backoff for a
day. The API's `/v1/webhooks` registers endpoints and shows every delivery and its attempts.
"""
