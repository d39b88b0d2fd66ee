#include "client/table.h"

#include <algorithm>

namespace quantd::client {

std::string FormatTable(const std::vector<std::vector<std::string>>& rows,
                        const std::string& align) {
  std::vector<size_t> width(align.size(), 0);
  for (const std::vector<std::string>& row : rows) {
    for (size_t c = 0; c < row.size() && c < width.size(); ++c) {
      width[c] = std::max(width[c], row[c].size());
    }
  }
  std::string out;
  for (const std::vector<std::string>& row : rows) {
    std::string line;
    for (size_t c = 0; c < row.size() && c < width.size(); ++c) {
      if (c > 0) line += "  ";
      const std::string pad(width[c] - row[c].size(), ' ');
      const bool last = c + 1 == row.size();
      if (align[c] == 'r') {
        line += pad + row[c];
      } else {
        line += last ? row[c] : row[c] + pad;
      }
    }
    out += line + "\n";
  }
  return out;
}

}  // namespace quantd::client
