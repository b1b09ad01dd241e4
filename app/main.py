"""kldiag dashboard. Start it with `kldiag dashboard RUN_DIR [RUN_DIR ...]`
(or `streamlit run app/main.py -- RUN_DIR ...`, or KLDIAG_RUNS=RUN_DIR streamlit run app/main.py)."""

from pathlib import Path

import dash_controls
import dash_data
import streamlit as st

# The favicon is served by the app itself: a ":material/...:" icon would be fetched from fonts.gstatic.com,
# a request that hangs on an offline cluster node.
st.set_page_config(page_title="kldiag", page_icon=str(Path(__file__).parent / "favicon.png"), layout="wide")

OVERVIEW = st.Page("app_pages/overview.py", title="Overview", icon=":material/dashboard:", url_path="home",
                   default=True)


def _overview_link() -> None:
    """/overview (the Overview's name in every link) opens the Overview, served at the root, with the link's query."""
    st.switch_page(OVERVIEW, query_params=dict(st.query_params))


PAGES = [
    OVERVIEW,
    st.Page("app_pages/distributions.py", title="Distributions", icon=":material/stacked_bar_chart:",
            url_path="distributions"),
    st.Page("app_pages/tokens.py", title="Tokens", icon=":material/flag:", url_path="tokens"),
    st.Page("app_pages/sequence.py", title="Sequence", icon=":material/notes:", url_path="sequence"),
    st.Page("app_pages/estimators.py", title="Estimators", icon=":material/functions:", url_path="estimators"),
    st.Page("app_pages/compare.py", title="Compare", icon=":material/compare_arrows:", url_path="compare"),
    st.Page("app_pages/mismatch.py", title="Mismatch", icon=":material/difference:", url_path="mismatch"),
    st.Page(_overview_link, title="Overview", url_path="overview", visibility="hidden"),
]

page = st.navigation(PAGES)
dash_controls.restore(dash_data.labels(dash_data.run_paths()))  # a deep link: run, step, sequence, token
dash_data.sidebar()
page.run()
