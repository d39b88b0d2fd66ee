// Where `quantd serve` listens by default, and so where quantctl connects by default: the unix
// socket quantd.sock in the default state directory (relative to the working directory).
#ifndef QUANTD_SERVER_API_DEFAULT_SOCKET_H_
#define QUANTD_SERVER_API_DEFAULT_SOCKET_H_

namespace quantd::api {

inline constexpr char kDefaultStateDir[] = "./quantd-state";
inline constexpr char kSocketFileName[] = "quantd.sock";
inline constexpr char kDefaultServerAddress[] = "unix:quantd-state/quantd.sock";

}  // namespace quantd::api

#endif  // QUANTD_SERVER_API_DEFAULT_SOCKET_H_
