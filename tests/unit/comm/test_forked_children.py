"""A forked child of a process that uses the mover backend closes the TCP connections it
inherits (mover_plugin.comm.forked_children), and the parent keeps them: a data loader's
forked workers must not keep gloo's sockets alive. Run in a separate interpreter, so that the
fork handler is not installed in the test process."""

import subprocess
import sys

SCENARIO = r'''
import os, socket
from mover_plugin.comm.forked_children import install

def state(descriptor):
    try:
        os.fstat(descriptor)
        return "kept"
    except OSError:
        return "closed"

server = socket.socket()
server.bind(("127.0.0.1", 0))
server.listen()
client = socket.create_connection(server.getsockname())
udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
unix_a, unix_b = socket.socketpair()
read_end, write_end = os.pipe()
install()
install()  # idempotent: one handler
pid = os.fork()
if pid == 0:
    held = [state(fd) for fd in (server.fileno(), client.fileno(), udp.fileno(),
                                 unix_a.fileno(), read_end, 1)]
    os._exit(0 if held == ["closed", "closed", "kept", "kept", "kept", "kept"] else 1)
_, status = os.waitpid(pid, 0)
print("child", os.waitstatus_to_exitcode(status))
print("parent", state(server.fileno()), state(client.fileno()))
client.sendall(b"x")  # the parent's connection still works
accepted, _ = server.accept()
print("received", accepted.recv(1).decode())
'''


def test_a_forked_child_closes_inherited_tcp_sockets_and_the_parent_keeps_them():
    result = subprocess.run([sys.executable, "-c", SCENARIO], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:3] == ["child 0", "parent kept kept", "received x"]
