"""CLG-SGD, cascading local-global SGD (paper 004, Bian et al., Sec. III-A, eqs. 3-5).

Each round t the server samples S_t and broadcasts x_t; every sampled client i runs K_i
local SGD steps from x_t (eq. 3),

    x^i_{t,k+1} = x^i_{t,k} - eta g^i_{t,k},

and uploads its model (Delta^i_t = x^i_{t,K} - x_t). The server aggregates (eq. 4),

    x^s_{t+1} = x_t + eta_g sum_{i in S_t} w_i Delta^i_t,

and then trains the result on its own data D_s^t for E steps at rate gamma (eq. 5,
:mod:`splitfed.algorithms.server_only`), which gives x_{t+1}.

Eqs. 3-4 are FedAvg's round (:mod:`splitfed.algorithms.fedavg`): K_i = ``train.local_steps``
or ceil(D_i / B) * ``train.local_epochs``, eta = ``env.lr(t)`` (``train.lr`` with the
Sec. VI decay), eta_g = ``global_lr`` (default 1, as in Sec. VI). The paper's 1/M is the
case w_i = 1/M (``participation.weighting=uniform``, or equal data sizes as in Sec. VI);
by default w_i are FedAvg's data-size weights (a_i / q_i under bernoulli participation).
With ``server_epochs=0`` CLG-SGD is FedAvg exactly (Remark 4; tested). Server data,
gamma, E and the decisions (docs/design.md) on the server's optimizer: see ``server_only``.
A round with an empty cohort keeps x_t and still trains the server (x^s = x_t).
Communication is FedAvg's: D_s^t never leaves the server.
"""

from __future__ import annotations

from splitfed.algorithms.fedavg import FedAvg
from splitfed.algorithms.server_only import ServerTrain
from splitfed.engine.algorithm import variant

CLGSGD = variant("CLGSGD", FedAvg, name="clgsgd", server=[ServerTrain],
                 reference="Bian et al. (paper 004), CLG-SGD, eqs. 3-5")
