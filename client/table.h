// Plain-text tables with aligned columns, for `list` and `report`.
#ifndef QUANTD_CLIENT_TABLE_H_
#define QUANTD_CLIENT_TABLE_H_

#include <string>
#include <vector>

namespace quantd::client {

// Rows (the first one is the heading) with columns two spaces apart. `align` has one letter per
// column: 'l' pads on the right, 'r' on the left (numbers). The last column is not padded when
// left-aligned; every line ends with "\n".
std::string FormatTable(const std::vector<std::vector<std::string>>& rows,
                        const std::string& align);

}  // namespace quantd::client

#endif  // QUANTD_CLIENT_TABLE_H_
