#!/usr/bin/env python3
"""Writes controlplane/openapi.json. Edit here, run it, commit both.

A unit test checks that every route the router serves is in the document.
"""
import json, pathlib

def ref(name): return {"$ref": f"#/components/schemas/{name}"}
def body(name): return {"required": True, "content": {"application/json": {"schema": ref(name)}}}
def ok(desc, schema=None):
    r = {"description": desc}
    if schema: r["content"] = {"application/json": {"schema": schema}}
    return r
ERR = {"content": {"application/json": {"schema": ref("Error")}}}
def errors(*codes):
    names = {"400": "invalid body or field", "401": "missing or bad token", "403": "missing permission",
             "404": "not found", "409": "conflict or version mismatch", "413": "body over 64 KiB",
             "503": "store unavailable"}
    return {c: {"description": names[c], **ERR} for c in codes}
STD = ("400", "401", "403", "413", "503")
def op(summary, perm, responses, req=None, params=None, secured=True):
    o = {"summary": summary + (f" Requires `{perm}`." if perm else ""), "responses": responses}
    if req: o["requestBody"] = body(req)
    if params: o["parameters"] = params
    if not secured: o["security"] = []
    return o
def p(name, where="path", typ="string", desc=None):
    d = {"name": name, "in": where, "required": where == "path", "schema": {"type": typ}}
    if desc: d["description"] = desc
    return d
T, NS, S, C, ID = p("tenant"), p("namespace"), p("stream"), p("cache"), p("node_id")
items = lambda name: {"type": "object", "properties": {"items": {"type": "array", "items": ref(name)}}}

paths = {
 "/v1/system/live": {"get": op("Liveness; never touches the store.", None, {"200": ok("live")}, secured=False)},
 "/v1/system/ready": {"get": op("Readiness: the store answers.", None, {"200": ok("ready"), **errors("503")}, secured=False)},
 "/v1/system/health": {"get": op("Same as ready.", None, {"200": ok("ready"), **errors("503")}, secured=False)},
 "/v1/openapi.json": {"get": op("This document.", None, {"200": ok("OpenAPI 3.0")}, secured=False)},
 "/internal/bootstrap": {"post": op("Creates the operator tenant and returns the first admin token. Needs header X-Felix-Bootstrap-Token; works once.", None,
    {"200": ok("token", ref("TokenAnswer")), **errors("401", "404", "409")}, req="Bootstrap", secured=False)},
 "/v1/tenants": {
    "get": op("Lists tenants.", "tenant.manage:cluster:*", {"200": ok("tenants", items("Tenant")), **errors(*STD)}),
    "post": op("Creates a tenant and its first signing key.", "tenant.manage:cluster:*", {"201": ok("created", ref("Tenant")), **errors(*STD, "409")}, req="Tenant")},
 "/v1/tenants/snapshot": {"get": op("Every tenant plus the change-log head.", "node.view:cluster:*", {"200": ok("snapshot"), **errors(*STD)})},
 "/v1/tenants/{tenant}": {"delete": op("Deletes an empty tenant and its keys.", "tenant.manage:cluster:*", {"204": ok("deleted"), **errors(*STD, "404", "409")}, params=[T])},
 "/v1/tenants/{tenant}/.well-known/jwks.json": {"get": op("The tenant's token verification keys (Ed25519 JWKs).", None, {"200": ok("JWKS", ref("Jwks")), **errors("404")}, params=[T], secured=False)},
 "/v1/tenants/{tenant}/tokens": {"post": op("Issues a broker- or control-plane-audience token with `perms`.", "tenant.manage:tenant:{tenant}",
    {"200": ok("token", ref("TokenAnswer")), **errors(*STD, "404")}, req="TokenRequest", params=[T])},
 "/v1/tenants/{tenant}/namespaces": {
    "get": op("Lists namespaces.", "ns.manage:namespace:{tenant}/*", {"200": ok("namespaces", items("Namespace")), **errors(*STD)}, params=[T]),
    "post": op("Creates a namespace.", "ns.manage:namespace:{tenant}/{namespace}", {"201": ok("created", ref("Namespace")), **errors(*STD, "404", "409")}, req="Namespace", params=[T])},
 "/v1/tenants/{tenant}/namespaces/{namespace}": {"delete": op("Deletes an empty namespace.", "ns.manage:namespace:{tenant}/{namespace}", {"204": ok("deleted"), **errors(*STD, "404", "409")}, params=[T, NS])},
 "/v1/tenants/{tenant}/namespaces/{namespace}/streams": {
    "get": op("Lists streams.", "stream.manage:stream:{tenant}/{namespace}/*", {"200": ok("streams", items("Stream")), **errors(*STD)}, params=[T, NS]),
    "post": op("Creates a stream; shard count and routing are fixed from then on.", "stream.manage:stream:{tenant}/{namespace}/{stream}", {"201": ok("created", ref("Stream")), **errors(*STD, "404", "409")}, req="StreamCreate", params=[T, NS])},
 "/v1/tenants/{tenant}/namespaces/{namespace}/streams/{stream}": {
    "get": op("One stream.", "stream.manage:stream:{tenant}/{namespace}/{stream}", {"200": ok("stream", ref("Stream")), **errors(*STD, "404")}, params=[T, NS, S]),
    "patch": op("Changes retention, consistency, delivery or durability; `version` makes it conditional.", "stream.manage:stream:{tenant}/{namespace}/{stream}", {"200": ok("updated", ref("Stream")), **errors(*STD, "404", "409")}, req="StreamPatch", params=[T, NS, S]),
    "delete": op("Deletes a stream and its assignments.", "stream.manage:stream:{tenant}/{namespace}/{stream}", {"204": ok("deleted"), **errors(*STD, "404")}, params=[T, NS, S])},
 "/v1/tenants/{tenant}/namespaces/{namespace}/caches": {
    "get": op("Lists caches.", "cache.manage:cache:{tenant}/{namespace}/*", {"200": ok("caches", items("Cache")), **errors(*STD)}, params=[T, NS]),
    "post": op("Creates a cache.", "cache.manage:cache:{tenant}/{namespace}/{cache}", {"201": ok("created", ref("Cache")), **errors(*STD, "404", "409")}, req="CacheCreate", params=[T, NS])},
 "/v1/tenants/{tenant}/namespaces/{namespace}/caches/{cache}": {
    "get": op("One cache.", "cache.manage:cache:{tenant}/{namespace}/{cache}", {"200": ok("cache", ref("Cache")), **errors(*STD, "404")}, params=[T, NS, C]),
    "delete": op("Deletes a cache and its assignments.", "cache.manage:cache:{tenant}/{namespace}/{cache}", {"204": ok("deleted"), **errors(*STD, "404")}, params=[T, NS, C])},
 "/v1/streams/snapshot": {"get": op("Every stream and cache (what brokers route by).", "node.view:cluster:*", {"200": ok("snapshot"), **errors(*STD)})},
 "/v1/nodes": {
    "get": op("The node catalog.", "node.view:cluster:*", {"200": ok("nodes", items("Node")), **errors(*STD)}),
    "post": op("Registers (or re-registers, new incarnation) a broker.", "node.manage:node:{node_id}", {"200": ok("registered", ref("Node")), **errors(*STD, "409")}, req="NodeRegistration")},
 "/v1/nodes/{node_id}": {
    "get": op("One node.", "node.view:cluster:*", {"200": ok("node", ref("Node")), **errors(*STD, "404")}, params=[ID]),
    "delete": op("Removes a node that is down or left and leads nothing.", "node.manage:cluster:*", {"204": ok("deleted"), **errors(*STD, "404", "409")}, params=[ID])},
 "/v1/nodes/{node_id}/heartbeat": {"post": op("Records a heartbeat (control plane's clock); answers lifecycle, heartbeat_interval_ms, expiry_timeout_ms and regrant_margin_ms. Older incarnation or a down node: 409.", "node.manage:node:{node_id}", {"200": ok("lifecycle and timing"), **errors(*STD, "404", "409")}, req="Heartbeat", params=[ID])},
 "/v1/shard-assignments": {"get": op("Every assignment.", "node.view:cluster:*", {"200": ok("assignments", items("Assignment")), **errors(*STD)})},
 "/v1/shard-assignments/snapshot": {"get": op("Every assignment plus `next_seq` to follow changes from.", "node.view:cluster:*", {"200": ok("snapshot"), **errors(*STD)})},
 "/v1/shard-assignments/changes": {"get": op("Assignment changes after `since`; waits up to `wait_ms` (max 25000) for one.", "node.view:cluster:*", {"200": ok("changes"), **errors(*STD)},
    params=[p("since", "query", "integer"), p("wait_ms", "query", "integer")])},
 "/v1/shard-moves": {"post": op("Moves a shard's leadership to a ready node (generation + 1).", "node.manage:cluster:*", {"200": ok("new assignment"), **errors(*STD, "404", "409")}, req="MoveRequest")},
 "/v1/nodes/{node_id}/replica-status": {"post": op("A leader reports what it and its followers durably hold, per shard. Kept in control-plane memory, only moving forward. 200 when every shard was accepted, 409 (same body plus code and message) otherwise.", "node.manage:node:{node_id}",
    {"200": ok("per-shard results", ref("ReplicaStatusAnswer")), **errors(*STD), "409": ok("some shard refused", ref("ReplicaStatusAnswer"))}, req="ReplicaStatus", params=[ID])},
 "/v1/placement/replication": {"get": op("Every shard with more than one replica: leader, generation, members with readiness and reported positions, under_replicated.", "node.view:cluster:*", {"200": ok("replicated shards", items("ReplicatedShard")), **errors(*STD)})},
 "/v1/placement/abandon": {"post": op("LOSES DATA. Places a shard whose leader is gone and that no member can take on the best ready node, with an empty log (generation + 1). 409 while the leader may hold its lease or a member could be promoted.", "node.manage:cluster:*",
    {"200": ok("lost_data, previous_leader, assignment"), **errors(*STD, "404", "409")}, req="ShardRef")},
}

s = lambda props, req=(): {"type": "object", "properties": props, **({"required": list(req)} if req else {})}
STR, INT, BOOL = {"type": "string"}, {"type": "integer", "minimum": 0}, {"type": "boolean"}
schemas = {
 "Error": s({"code": STR, "message": STR, "field": STR}, ["code", "message"]),
 "Bootstrap": s({"principal": STR}),
 "TokenAnswer": s({"token": STR, "kid": STR, "tenant_id": STR, "expires_in": INT}, ["token"]),
 "TokenRequest": s({"sub": STR, "audience": {"type": "string", "enum": ["felix-broker", "felix-controlplane"]},
                    "perms": {"type": "array", "items": STR}, "ttl_seconds": INT}, ["sub", "audience", "perms"]),
 "Jwks": s({"keys": {"type": "array", "items": s({"kty": STR, "crv": STR, "kid": STR, "x": STR, "alg": STR, "use": STR})}}),
 "Tenant": s({"tenant_id": STR, "display_name": STR}, ["tenant_id"]),
 "Namespace": s({"tenant_id": STR, "namespace": STR, "display_name": STR}, ["namespace"]),
 "Retention": s({"max_age_seconds": INT, "max_size_bytes": INT}),
 "StreamCreate": s({"stream": STR, "kind": {"type": "string", "enum": ["Stream", "Queue", "Cache"]}, "shards": INT,
                    "replication_factor": INT, "retention": ref("Retention"),
                    "consistency": {"type": "string", "enum": ["Leader", "Quorum"]},
                    "delivery": {"type": "string", "enum": ["AtMostOnce", "AtLeastOnce"]}, "durable": BOOL,
                    "routing": {"type": "string", "enum": ["modulo", "jump_hash"]}}, ["stream", "kind", "shards"]),
 "Stream": {"allOf": [ref("StreamCreate"), s({"tenant_id": STR, "namespace": STR, "version": INT})]},
 "StreamPatch": s({"retention": ref("Retention"), "consistency": STR, "delivery": STR, "durable": {"type": "boolean", "description": "fixed at creation: only the stream's current value is taken (400 otherwise)"}, "version": INT}),
 "CacheCreate": s({"cache": STR, "display_name": STR, "shards": INT, "replication_factor": INT,
                   "consistency": {"type": "string", "enum": ["Leader", "Quorum"]}}, ["cache"]),
 "Cache": {"allOf": [ref("CacheCreate"), s({"tenant_id": STR, "namespace": STR, "version": INT})]},
 "NodeRegistration": s({"node_id": STR, "client_addr": STR, "advertise_addr": STR, "region": STR,
                        "capacity": s({"max_shards": INT})}, ["node_id"]),
 "Node": {"allOf": [ref("NodeRegistration"), s({"lifecycle": {"type": "string", "enum": ["live", "draining", "down", "left"]},
                                                "incarnation": INT, "last_heartbeat_ms": INT})]},
 "Heartbeat": s({"incarnation": INT}, ["incarnation"]),
 "Assignment": s({"tenant_id": STR, "namespace": STR, "kind": {"type": "string", "enum": ["stream", "cache"]}, "name": STR,
                  "shard": INT, "leader": STR, "replicas": {"type": "array", "items": STR}, "generation": INT,
                  "state": STR, "routing": STR,
                  "under_replicated": {"type": "boolean", "description": "list and snapshot only: fewer ready members than members, or a halted follower"},
                  "positions": {"type": "object", "additionalProperties": INT, "description": "list and snapshot only: node_id -> reported durable end"}}),
 "Follower": s({"node_id": STR, "durable_end": INT, "halted": BOOL}, ["node_id", "durable_end"]),
 "ShardReport": s({"kind": {"type": "string", "enum": ["stream", "cache"]}, "tenant_id": STR, "namespace": STR, "name": STR,
                   "shard": INT, "generation": INT, "log_end": INT, "commit": INT,
                   "followers": {"type": "array", "items": ref("Follower")}},
                  ["kind", "tenant_id", "namespace", "name", "shard", "generation", "log_end", "commit"]),
 "ReplicaStatus": s({"shards": {"type": "array", "items": ref("ShardReport")}}, ["shards"]),
 "ReplicaStatusAnswer": s({"code": STR, "message": STR, "results": {"type": "array", "items": s({
     "kind": STR, "tenant_id": STR, "namespace": STR, "name": STR, "shard": INT, "generation": INT,
     "result": {"type": "string", "enum": ["accepted", "stale", "not_leader", "unassigned", "future_generation"]}})}}),
 "ReplicatedShard": s({"kind": STR, "tenant_id": STR, "namespace": STR, "name": STR, "shard": INT, "leader": STR,
                       "generation": INT, "under_replicated": BOOL,
                       "members": {"type": "array", "items": s({"node_id": STR, "leader": BOOL, "ready": BOOL,
                                                                "position": INT, "halted": BOOL})},
                       "report": s({"from": STR, "generation": INT, "log_end": INT, "commit": INT, "age_ms": INT})}),
 "ShardRef": s({"kind": {"type": "string", "enum": ["stream", "cache"]}, "tenant_id": STR, "namespace": STR, "name": STR, "shard": INT},
               ["kind", "tenant_id", "namespace", "name", "shard"]),
 "MoveRequest": s({"tenant_id": STR, "namespace": STR, "stream": STR, "shard": INT,
                   "kind": {"type": "string", "enum": ["stream", "cache"]}, "destination": STR},
                  ["tenant_id", "namespace", "stream", "shard", "destination"]),
}
doc = {"openapi": "3.0.3",
       "info": {"title": "Felix control plane", "version": "0.1.0",
                "description": "Tenants, namespaces, streams, caches, nodes and shard assignments. Every error is JSON {code, message, field?}."},
       "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer", "bearerFormat": "JWT (EdDSA, audience felix-controlplane)"}},
                      "schemas": schemas},
       "security": [{"bearer": []}],
       "paths": paths}
out = pathlib.Path(__file__).resolve().parent.parent / "openapi.json"
out.write_text(json.dumps(doc, indent=1) + "\n")
