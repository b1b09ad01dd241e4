"""The Sequence page's group view: the other completions of the same GRPO prompt side by side
(text, advantage, reward when recorded, worst tokens), groups with zero reward spread marked.
Tables come from kldiag.views.groups; this module only displays them."""

from __future__ import annotations

import dash_controls as K
import dash_data as D
import pandas as pd
import streamlit as st

from kldiag import format as F
from kldiag.views import groups as VG
from kldiag.views import pages as V
from kldiag.views import sequences as VS

PER_ROW = 4
TOKENS_SHOWN = 400  # tokens of each sibling rendered as coloured text


@st.cache_data(max_entries=32, show_spinner=False)
def group_tokens(path: str, step: int, seqs: tuple[int, ...], keys: str) -> dict[int, pd.DataFrame]:
    """Tokens of the group's completions, read in one pass (keyed on the run's parts)."""
    return VS.group_tokens(D.analysis_of(path, keys), step, seqs, vocab=D._vocab(path, F.vocab_stamp(path)))


def show(run: D.Loaded, step: int, seq: int, quantity: str) -> None:
    at = D.step_sequences(run.path, run.keys, step)  # the step's sequences only (a long run's stay on disk)
    sib = VG.siblings(at, step, seq)
    if sib.empty:
        return
    group = int(at.loc[at["seq"] == seq, "group"].iloc[0])
    spread = VG.group_spread(at)
    zero = int(spread["zero_spread"].sum())
    st.subheader(f"Group {group}: {len(sib)} completion{'s' if len(sib) > 1 else ''} of the same prompt")
    of = VG.spread_column(at)
    st.caption(f"{zero} of {len(spread)} groups at step {step} have zero {of} spread.")
    if bool(sib["zero_spread"].iloc[0]):
        st.warning(f"Zero {of} spread: every completion of this group got the same reward, so GRPO's advantage "
                   "is 0 for all of them. This prompt gives no policy gradient; only the KL term acts on it.",
                   icon=":material/horizontal_rule:")
    if len(sib) == 1:
        st.caption("This completion is alone in its group at this step.")
        return
    st.dataframe(sib, hide_index=True, width="stretch", key="seq_group_table")
    K.downloads(sib, f"group-{step}-{group}", "seq_group")
    tokens = group_tokens(run.path, step, tuple(int(s) for s in sib["seq"]), run.keys)
    rows = sib.to_dict("records")
    for start in range(0, len(rows), PER_ROW):
        cols = st.columns(PER_ROW)
        for col, r in zip(cols, rows[start:start + PER_ROW], strict=False):
            with col.container(border=True):
                _sibling(r, tokens.get(int(r["seq"]), pd.DataFrame()), quantity)


def _sibling(r: dict, toks: pd.DataFrame, quantity: str) -> None:
    reward = f" · reward {r['reward']:.3g}" if "reward" in r and pd.notna(r.get("reward")) else ""
    me = " (this one)" if r["self"] else ""
    st.markdown(f"**seq {int(r['seq'])}{me}**  \nadvantage {r['advantage']:.3g}{reward} · "
                f"max |k3 weight| {r['weight_k3_abs_max']:.3g} · flagged {int(r['flagged_count'])}")
    if toks.empty:
        st.caption("No tokens in the published parts.")
        return
    worst = VG.worst_tokens(toks, 3)
    st.caption("worst: " + " · ".join(f"pos {int(w.pos)} ({w.weight_k3:.3g})" for w in worst.itertuples()))
    st.html(f'<div class="kldiag-sibling" data-seq="{int(r["seq"])}">'
            f"{V.sequence_html(toks.iloc[:TOKENS_SHOWN], quantity)}</div>")
