"""Wrong tokens and wrong tenants are refused with the SDK's typed errors."""
import felix

from common import check, connect

for name, kwargs in [
    ("a malformed token", dict(token="garbage")),
    ("a token for another tenant's name", dict(tenant="intruder")),
    ("a forged token", dict(token=None, forge=True)),
]:
    forge = kwargs.pop("forge", False)
    if forge:
        import sys
        good = open(sys.argv[2]).read().strip()
        head, claims, sig = good.split(".")
        sig = ("A" if sig[0] != "A" else "B") + sig[1:]
        kwargs["token"] = ".".join([head, claims, sig])
    try:
        connect(**kwargs).publish("dev", "default", "s", b"x")
        check(False, name + " is refused")
    except felix.AuthError as e:
        check(e.code == "unauthenticated", name + " is an AuthError with code unauthenticated")

c = connect()
try:
    c.publish("other", "default", "s", b"x")
    check(False, "publishing into another tenant is refused")
except felix.FelixError as e:
    check(e.code == "forbidden", "publishing into another tenant is forbidden (%s)" % e.code)
try:
    c.publish("dev", "default", "../etc", b"x")
    check(False, "an invalid stream name is refused")
except felix.FelixError as e:
    check(e.code == "invalid_request", "an invalid stream name is invalid_request")
