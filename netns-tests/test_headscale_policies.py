"""The install guide's policy examples, loaded into the lab's real headscale: each example marked for the lab's
headscale minor (HEADSCALE_VERSION, default the pinned v0.29.2) is accepted by `headscale policy set`, as a user
following the guide would load it; on the versions without `autogroup:member` (0.26) or grants (0.27, 0.28)
the newest minor's example is refused, so the guide's per-version examples are the ones to use there (0.26
accepts grants and ignores them).
`make compat` runs every version; `HEADSCALE_VERSION=v0.26.1 pytest netns-tests/test_headscale_policies.py`
one."""
from __future__ import annotations

import pytest

from labtools.hsmatrix import doc_policies, minor
from labtools.lab import LabError

pytestmark = [pytest.mark.netns, pytest.mark.e2e, pytest.mark.timeout(120)]


def load(lab, text: str) -> str:
    """`headscale policy set` of the text: "" when accepted, else headscale's refusal."""
    f = lab.run_dir / "hs" / "doc-policy.hujson"
    f.write_text(text)
    try:
        lab.hs("policy", "set", "-f", str(f))
    except LabError as e:
        return str(e)
    return ""


@pytest.fixture
def admin(lab):
    # the examples name the user admin@
    if not any(u.get("name") == "admin" for u in lab.hs("users", "list") or []):
        lab.create_user("admin")
    yield
    load(lab, lab.hs_open_policy)


def test_each_example_for_this_version_is_accepted(lab, admin):
    mine = [(name, text) for name, minors, text in doc_policies() if minor(lab.hs_version) in minors]
    assert {n for n, _ in mine} >= {"minimal", "tags", "routes"}, mine
    refused = {name: err for name, text in mine if (err := load(lab, text))}
    assert refused == {}, refused


def test_the_newest_examples_where_this_version_lacks_their_features(lab, admin):
    newest = {name: text for name, minors, text in doc_policies() if "0.29" in minors}
    m = minor(lab.hs_version)
    if m == "0.29":
        pytest.skip("the newest examples are this version's (the test above)")
    if m == "0.26":
        assert "autogroup:member" in load(lab, newest["minimal"])
    if m in ("0.27", "0.28"):
        assert load(lab, newest["grants"]) != "", "grants accepted by a headscale that has none"
    if m == "0.26":
        # 0.26 reads its policy without refusing unknown fields: the grants are accepted and do nothing (which the
        # guide says; the controller's Warning event names the version)
        assert load(lab, newest["grants"]) == ""
