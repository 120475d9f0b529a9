// The transport of this process: the one place that knows both concrete transports
// (transport/tcp, transport/ib). R2CCL_TRANSPORT=tcp picks TCP; ib the verbs transport
// (init fails, naming the reason, without a verbs library or an active HCA port); auto
// (default) the verbs transport when any HCA port selected by R2CCL_IB_HCA is active, else
// TCP. One transport per process, so a RoCE NIC is never exposed twice (as an HCA and as its
// netdev). Registered explicitly here: no static self-registration (the linker drops it).
// Thread: any; the first call decides, later ones return the same transport or error.
#pragma once

#include <string>

#include "r2ccl/status.h"
#include "transport/transport.h"

namespace r2ccl::net {

// The transport, created at the first call. *why says what decided (for the init banner).
// Errors: kInvalidUsage for a bad variable, kSystem for R2CCL_TRANSPORT=ib without a verbs
// library or an active port; *err names the cause.
Status get_transport(Transport** out, std::string* why, std::string* err);
// Already created, else nullptr (tools, statistics).
Transport* peek_transport();

}  // namespace r2ccl::net
