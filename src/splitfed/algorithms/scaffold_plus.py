"""SCAFFOLD+ (paper 004, Bian et al., Sec. VI-A4 baseline (4)): SCAFFOLD, then the
server's local training on D_s^t.

"To enable a fair comparison ... we have incorporated the alternating training concept
from CLG-SGD into SCAFFOLD": each round is a full SCAFFOLD round (Karimireddy et al.
2020, Algorithm 1 with option II control variates; :mod:`splitfed.algorithms.scaffold`:
corrected local steps y_i <- y_i - eta (g_i - c_i + c), aggregation
x^s = x_t + eta_g sum_i w_i (y_i - x_t), control updates), followed by E server steps on
D_s^t at rate gamma from x^s (eq. 5 of paper 004, :mod:`splitfed.algorithms.server_only`).

Decisions (docs/design.md): the controls c, c_i are SCAFFOLD's, computed from the clients' local
work only (option II uses x_t - y_i); the server's steps do not enter them. Everything
else (weights, BatchNorm buffers, communication: 2x FedAvg's model bytes) is SCAFFOLD's;
server options (gamma, E, B_s) and server data are CLG-SGD's. With ``server_epochs=0``
SCAFFOLD+ is SCAFFOLD exactly.
"""

from __future__ import annotations

from splitfed.algorithms.fedavg import FedAvg
from splitfed.algorithms.scaffold import ScaffoldControls
from splitfed.algorithms.server_only import ServerTrain
from splitfed.engine.algorithm import variant

ScaffoldPlus = variant(
    "ScaffoldPlus", FedAvg, name="scaffold_plus", gradient=[ScaffoldControls],
    server=[ServerTrain], reference="Bian et al. (paper 004), Sec. VI baseline SCAFFOLD+: "
    "SCAFFOLD (Karimireddy et al. 2020, option II) then eq. 5")
