"""Layer 6: the sans-IO protocols (client<->daemon, daemon<->daemon).

Bytes in, messages out; messages in, bytes out. No trio, no sockets. The
human-readable spec is ``proto/PROTOCOL.md``. The one table of error codes
(``ERRORS``) lives here too; the I/O that drives a ``Connection`` is
``p2pxfer._pump``.
"""

from ._connection import CLOSED as CLOSED
from ._connection import NEED_DATA as NEED_DATA
from ._connection import Connection as Connection
from ._errors import ERRORS as ERRORS
from ._errors import LocalProtocolError as LocalProtocolError
from ._errors import ProtocolError as ProtocolError
from ._errors import RemoteProtocolError as RemoteProtocolError
from ._errors import check_handlers as check_handlers
from ._errors import error_from_wire as error_from_wire
from ._errors import is_fatal as is_fatal
from ._errors import wire_error as wire_error
from ._frames import DEFAULT_MAX_FRAME as DEFAULT_MAX_FRAME
from ._frames import FrameDecoder as FrameDecoder
from ._frames import encode_frame as encode_frame
from ._messages import CLIENT_REQUESTS as CLIENT_REQUESTS
from ._messages import MAX_REASON as MAX_REASON
from ._messages import PEER_REQUESTS as PEER_REQUESTS
from ._messages import SCHEMA as SCHEMA
from ._messages import SCHEMA_VERSION as SCHEMA_VERSION
from ._messages import Message as Message
from ._messages import check_reason as check_reason
from ._messages import pack_scatter as pack_scatter
from ._messages import unpack_scatter as unpack_scatter
from ._transitions import INITIATOR as INITIATOR
from ._transitions import RESPONDER as RESPONDER
from ._transitions import State as State
