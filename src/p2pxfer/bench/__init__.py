"""``p2pxfer bench``: the standalone bandwidth test, as a library.

The one harness for "ours against the reference" measurements.
``run_bench(BenchOptions(...))`` measures our path (the engine, or the
daemons) against the C reference over the same provider and pattern in the
same run (C at both ends where the target runs on this host, as fabtests'
``fi_rma_bw``; optionally Mooncake Transfer Engine beside them), plus this
machine's memcpy bandwidth; ``serve`` is the target side for two-machine
runs. ``run_scenario`` runs the other scenarios (dry run, latency and
ping-pong, idle, KV push, control round trip). The CLI (``p2pxfer bench``,
``python -m p2pxfer.bench``) only parses options and renders
(``summary_table``, ``write_json``, ``write_document``, ``plot``).
"""

from ._calibrate import calibrate as calibrate
from ._options import DEFAULT_PORT as DEFAULT_PORT
from ._options import BenchConfigError as BenchConfigError
from ._options import BenchError as BenchError
from ._options import BenchOptions as BenchOptions
from ._options import Case as Case
from ._options import build_cases as build_cases
from ._options import format_size as format_size
from ._options import parse_hostport as parse_hostport
from ._options import parse_size as parse_size
from ._options import sweep_sizes as sweep_sizes
from ._report import RESULT_FIELDS as RESULT_FIELDS
from ._report import BenchResult as BenchResult
from ._report import RailResult as RailResult
from ._report import plot as plot
from ._report import plot_series as plot_series
from ._report import read_json as read_json
from ._report import require_matplotlib as require_matplotlib
from ._report import summary_table as summary_table
from ._report import summary_tables as summary_tables
from ._report import write_document as write_document
from ._report import write_json as write_json
from ._run import BenchReport as BenchReport
from ._run import NullProgress as NullProgress
from ._run import Progress as Progress
from ._run import measure_memcpy as measure_memcpy
from ._run import run_bench as run_bench
from ._scenarios import SCENARIOS as SCENARIOS
from ._scenarios import run_scenario as run_scenario
from ._server import ServerConfig as ServerConfig
from ._server import serve as serve
